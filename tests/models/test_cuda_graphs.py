"""rollout.cuda_graphs: GraphedForward's bookkeeping, checked on the CPU with a stand-in for the
CUDA capture (a replay re-runs the forward on the static buffers, writing into the static
outputs, as a graph's replay does). The real capture runs on the GPU (benchmarks/
continuous_batching.py --cuda-graphs; `diffrl bench rollout ... rollout.cuda_graphs=true`)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from diffrl.errors import ConfigError
from diffrl.models.graphs import Captured, GraphedForward, graph_transformer, static_call
from diffrl.models.registry import ModelConfig, load_model
from diffrl.rollout.engine import RolloutConfig, RolloutEngine


class CpuGraphs(GraphedForward):
    """GraphedForward with the CUDA parts replaced: captures on the CPU."""

    def __init__(self, forward, fail_on=None, **kw):
        super().__init__(forward, **kw)
        self.fail_on = fail_on
        self.forward_calls = 0
        inner = self.forward

        def counted(*a, **k):
            self.forward_calls += 1
            return inner(*a, **k)

        self.forward = counted

    def capturable(self) -> bool:
        return True

    def on_device(self, t) -> bool:
        return True

    def capture(self, leaves, spec):
        from torch.utils._pytree import tree_flatten

        if self.fail_on is not None and self.fail_on(leaves):
            raise RuntimeError("operation not permitted when stream is capturing")
        inputs, args, kwargs = static_call(leaves, spec)
        outputs = self.forward(*args, **kwargs)
        out_leaves, _ = tree_flatten(outputs)

        def replay():
            fresh, _ = tree_flatten(self.forward(*args, **kwargs))
            for buf, new in zip(out_leaves, fresh, strict=True):
                buf.copy_(new)

        return Captured(replay, inputs, outputs)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=1.0, *, extra=None):
        y = self.lin(x) * scale
        return (y if extra is None else y + extra, y.sum())


def test_replays_after_one_eager_call_and_matches_eager():
    net = Net()
    g = CpuGraphs(net.forward)
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = net(x)
        first = g(x)  # eager
        second = g(x)  # captured, then replayed
        third = g(x + 1)  # replayed on new inputs
    assert g.stats["eager"] == 1 and g.stats["captured"] == 1 and g.stats["replayed"] == 2
    for got in (first, second):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(third, net(x + 1))


def test_results_are_clones_not_the_static_buffers():
    net = Net()
    g = CpuGraphs(net.forward)
    with torch.no_grad():
        g(torch.zeros(2, 4))
        a = g(torch.zeros(2, 4))
        kept = a[0].clone()
        g(torch.ones(2, 4))  # overwrites the static outputs
    torch.testing.assert_close(a[0], kept)


def test_key_separates_shapes_values_and_kwargs():
    net = Net()
    g = CpuGraphs(net.forward)
    with torch.no_grad():
        for _ in range(2):
            g(torch.randn(2, 4))
            g(torch.randn(5, 4))  # another shape: its own graph
            g(torch.randn(2, 4), 2.0)  # a non-tensor argument is part of the key
            g(torch.randn(2, 4), extra=torch.ones(2, 4))
        y = g(torch.ones(2, 4), 2.0)
    assert g.stats["captured"] == 4 and len(g.graphs) == 4
    torch.testing.assert_close(y[0], net(torch.ones(2, 4), 2.0)[0].detach())


def test_grad_mode_runs_eagerly_with_gradients():
    net = Net()
    g = CpuGraphs(net.forward)
    x = torch.randn(2, 4)
    for _ in range(3):
        y, _ = g(x)
    assert g.stats["eager"] == 3 and not g.graphs
    y.sum().backward()
    assert net.lin.weight.grad is not None


def test_least_recently_replayed_is_evicted():
    net = Net()
    g = CpuGraphs(net.forward, max_graphs=2)
    with torch.no_grad():
        for n in (1, 2, 3):
            g(torch.randn(n, 4))
            g(torch.randn(n, 4))
    assert g.stats["evicted"] == 1
    assert sorted(k[1][0][1][0] for k in g.graphs) == [2, 3]


def test_a_failed_capture_runs_eagerly_with_one_warning(caplog):
    net = Net()
    g = CpuGraphs(net.forward, fail_on=lambda leaves: leaves[0].shape[0] == 3)
    x = torch.randn(3, 4)
    with torch.no_grad(), caplog.at_level(logging.WARNING):
        outs = [g(x) for _ in range(4)]
    assert g.stats["failed"] == 1 and not g.graphs
    assert sum("cannot be captured" in r.message for r in caplog.records) == 1
    for y in outs:
        torch.testing.assert_close(y[0], net(x)[0].detach())


def test_weights_changed_in_place_are_seen_by_the_replay():
    net = Net()
    g = CpuGraphs(net.forward)
    x = torch.randn(2, 4)
    with torch.no_grad():
        g(x), g(x)
        net.lin.weight.mul_(2.0)  # as weight sync writes
        y = g(x)
        torch.testing.assert_close(y[0], net(x)[0])


def test_rollout_cuda_graphs_needs_a_cuda_device():
    model = load_model(ModelConfig(family="sd3", preset="sd35-tiny", resolution=32), "cpu")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        RolloutEngine(model, RolloutConfig(cuda_graphs=True), [], torch.device("cpu"))


def test_the_rollout_samples_the_same_with_graphs_standing_in():
    """The engine with its transformer's forward graphed (the CPU stand-in) samples the same
    latents as without, and replays every step after the first of each shape."""
    model = load_model(ModelConfig(family="sd3", preset="sd35-tiny", resolution=32), "cpu")
    cfg = RolloutConfig(group_size=2, num_steps=3, cfg_scale=2.0, max_batch=4)
    plain = RolloutEngine(model, cfg, [], torch.device("cpu"))
    graphed = RolloutEngine(model, cfg, [], torch.device("cpu"))
    t = graphed.model.net.transformer
    g = CpuGraphs(t.forward)
    t.forward = g
    ids = model.family.tokenize(["a red circle", "a blue square"]).input_ids
    seeds = torch.arange(4)
    sig = torch.linspace(1, 0, 4)
    mask = torch.zeros(3, dtype=torch.bool)
    with torch.no_grad():
        a = plain._sample(ids.repeat_interleave(2, 0), seeds, sig, mask, 2)[0]
        b = graphed._sample(ids.repeat_interleave(2, 0), seeds, sig, mask, 2)[0]
    torch.testing.assert_close(a, b)
    assert g.stats == {"eager": 1, "captured": 1, "replayed": 2, "failed": 0, "evicted": 0}


def test_graph_transformer_needs_a_transformer():
    model = load_model(ModelConfig(), "cpu")  # the tiny DiT: no diffusers transformer
    with pytest.raises(ValueError, match="no diffusers transformer"):
        graph_transformer(model)
