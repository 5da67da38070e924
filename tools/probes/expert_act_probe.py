"""Device probe: the expert activation on the packed gate_up output, split inside the compiled function (the current
expert_activation) against split outside it (the earlier form: autograd then concatenates the two halves' gradients
in a separate copy). bench moe's shape: 32768 tokens x top-8 rows, hidden 256, bf16; forward+backward, one process.
Writes $OUT/expert_act_probe.json."""
import json, os, time
import torch
from triton.testing import do_bench
from moe_book.layers.base import fused
from moe_book.layers.moe import ACTIVATIONS, expert_activation

OUT = os.environ.get("OUT", "/tmp")
ROWS, HIDDEN = 32768 * 8, 256
split_outside = {name: fused(fn) for name, fn in ACTIVATIONS.items()}


def timed(fn, h, g):
    def step():
        h.grad = None
        fn(h).backward(g)
    return do_bench(step, warmup=10, rep=100)


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(ROWS, 2 * HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    g = torch.randn(ROWS, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    rows = []
    for name in ACTIVATIONS:
        inside = lambda x: expert_activation(name, x)
        outside = lambda x: split_outside[name](*x.chunk(2, dim=-1))
        y1 = inside(h); (d1,) = torch.autograd.grad(y1, h, g)
        y2 = outside(h); (d2,) = torch.autograd.grad(y2, h, g)
        same = bool(torch.equal(y1, y2) and torch.equal(d1, d2))
        ms_in, ms_out = timed(inside, h, g), timed(outside, h, g)
        rows.append(dict(act=name, ms_split_inside=ms_in, ms_split_outside=ms_out, bit_identical=same))
        print(f"{name}: split inside {ms_in:.3f} ms, outside {ms_out:.3f} ms, identical {same}", flush=True)
    out = dict(probe="expert_act_probe", device=torch.cuda.get_device_name(), torch=torch.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S"), shape=dict(rows=ROWS, hidden=HIDDEN, dtype="bf16"), rows=rows)
    with open(os.path.join(OUT, "expert_act_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
