import sys, torch
from diffusion_policy_accelerated import ops
dtype = getattr(torch, sys.argv[1]); cin, cout, L = map(int, sys.argv[2].split(","))
g = torch.Generator().manual_seed(0)
x = torch.randn(1, cin, L, generator=g).cuda().to(dtype)
w = (torch.randn(cout, cin, 5, generator=g) / (cin * 5) ** 0.5).cuda().to(dtype)
o = ops.conv1d_gn_mish(x, w, None, None, None, 8); torch.cuda.synchronize()
ref = torch.nn.functional.mish(torch.nn.functional.group_norm(torch.nn.functional.conv1d(x.double(), w.double(), padding=2), 8))
print(sys.argv[1:], "ok", (o.double() - ref).abs().max().item(), flush=True)
