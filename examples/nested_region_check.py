"""Does torch compile a repeated block as a nested compile region and get the same gradients as eager?

    python examples/nested_region_check.py [--compiler inductor|aot_eager] [--layers 2]

fxshard's plan to compile a repeated block once (docs/architecture.md, "Compile time and depth") rests on torch's
``torch.compiler.nested_compile_region``. This check trains nothing: it builds the benchmark GPT of
``examples/models.py``, marks ``Block.forward`` as a nested compile region, and compares every parameter's gradient
after one backward under ``torch.compile`` with the eager one. It prints the worst relative difference and exits 1
where it exceeds 1e-4 (fp32 reorderings stay near 1e-6).
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from examples.models import GPT, Block, GPTConfig, gpt_batch

TOLERANCE = 1e-4


def worst_gradient_difference(compiler: str, layers: int) -> tuple[float, str]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=128, block_size=16, n_layer=layers, n_head=4, d_model=64)
    model = GPT(config)
    reference = copy.deepcopy(model)
    batch = gpt_batch(config, 4, torch.Generator().manual_seed(0))
    reference(*batch).backward()
    plain = Block.forward
    Block.forward = torch.compiler.nested_compile_region(plain)
    try:
        torch.compile(model, backend=compiler, fullgraph=True)(*batch).backward()
    finally:
        Block.forward = plain
    return max((((p.grad - q.grad).abs().max() / q.grad.abs().max()).item(), name)
               for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compiler", default="inductor", help="torch.compile backend (inductor)")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    difference, name = worst_gradient_difference(args.compiler, args.layers)
    verdict = "same as eager" if difference <= TOLERANCE else "WRONG"
    print(f"torch {torch.__version__}, {args.compiler}, {args.layers} blocks as a nested compile region: worst "
          f"relative gradient difference {difference:.2e} ({name}): {verdict}")
    return 0 if difference <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
