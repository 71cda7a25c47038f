"""``identity.loaded_weights_digest``: the digest a worker compares at each cache reset."""

from __future__ import annotations

import torch

from lmcache_p2p.identity import loaded_weights_digest as weights_digest


class _Model:
    """What the digest reads of a ``torch.nn.Module``: its named parameters and buffers."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        g = torch.Generator().manual_seed(0)
        self.params = {"embed.weight": torch.randn(300, 64, generator=g).to(dtype),
                       "proj.weight": torch.randn(64, 64, generator=g).to(dtype),
                       "proj.bias": torch.randn(64, generator=g).to(dtype),
                       "norm.weight": torch.ones(64, dtype=dtype)}
        self.buffers: dict[str, torch.Tensor] = {}

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.params.items())

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.buffers.items())


def test_the_same_weights_give_the_same_digest_anywhere_they_are_loaded() -> None:
    assert weights_digest(_Model()) == weights_digest(_Model())
    model = _Model()
    before = weights_digest(model)
    for p in model.params.values():
        p.mul_(1.0)  # rewritten unchanged
    assert weights_digest(model) == before


def test_any_update_of_one_value_a_dtype_or_a_shape_changes_it() -> None:
    model = _Model()
    before = weights_digest(model)
    model.params["proj.weight"][17, 3] += 1e-3  # one element, off the sampled strides
    assert weights_digest(model) != before
    assert weights_digest(_Model(torch.bfloat16)) != weights_digest(_Model())
    fewer = _Model()
    del fewer.params["norm.weight"]
    assert weights_digest(fewer) != weights_digest(_Model())
    reshaped = _Model()
    reshaped.params["proj.bias"] = reshaped.params["proj.bias"].reshape(8, 8)
    assert weights_digest(reshaped) != weights_digest(_Model())


def test_integer_storage_is_read_as_it_is() -> None:
    model = _Model()
    model.buffers["q"] = torch.arange(1000).to(torch.int8).reshape(10, 100)
    before = weights_digest(model)
    model.buffers["q"][9, 99] += 1
    assert weights_digest(model) != before
