"""engine.kernels.gemv: linears as batched GEMVs give what the linears give, on the same parameters."""

import pytest
import torch

from engine.kernels.gemv import GemvLinear, batched_gemv, with_gemv_linears


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 24), (1, 9, 24), (40, 24), (2, 3, 5, 24)])
def test_batched_gemv_equals_the_linear(shape, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 17, bias=bias)
    x = torch.randn(shape)
    out = batched_gemv(linear, x)
    assert out.shape == (*shape[:-1], 17)
    assert torch.allclose(out, linear(x), atol=1e-6)


def test_with_gemv_linears_wraps_every_linear_and_shares_the_parameters():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                              torch.nn.ModuleList([torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)]))
    gemv = with_gemv_linears(net)
    assert isinstance(gemv[0], GemvLinear) and isinstance(gemv[2][1], GemvLinear) and gemv[2][0].weight is net[2][0].weight
    assert isinstance(net[0], torch.nn.Linear)  # the original is left as it was
    assert gemv[0].linear.weight is net[0].weight
    x = torch.randn(3, 8)
    assert torch.allclose(gemv[2][1](gemv[2][0](gemv[1](gemv[0](x)))), net[2][1](net[2][0](net[1](net[0](x)))),
                          atol=1e-6)
    with torch.no_grad():
        net[0].weight.add_(1.0)  # a change to the original's weights is seen through the copy
    assert torch.allclose(gemv[0](x), net[0](x), atol=1e-6)
