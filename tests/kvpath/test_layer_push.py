"""The layer-wise push model shared by the emulated engines and the simulation."""

import itertools

import pytest

from kvpath.layer_push import LayerPushError, group_bytes, layer_done_times, plan_push


def test_a_request_push_starts_when_the_prefill_ends():
    p = plan_push(1.0, 1.4, layers=32, nbytes=8_000_000, rate_bytes_s=1e8)
    assert (p.start_s, p.end_s, p.sent_before(1.4)) == (1.4, pytest.approx(1.48), 0)


@pytest.mark.parametrize("tc,tt,layers", [(0.4, 0.08, 32), (0.1, 0.5, 16), (0.2, 0.2, 4), (0.3, 0.0, 8)])
def test_a_layer_push_ends_at_the_pipelines_bound(tc, tt, layers):
    """Uniform layers, one lane: max(Tc + Tt/L, Tt + Tc/L), never later than Tc + Tt."""
    p = plan_push(0.0, tc, layers, nbytes=10_000 * layers, rate_bytes_s=10_000 * layers / tt if tt else 1e18,
                  granularity="layer")
    assert p.end_s == pytest.approx(max(tc + tt / layers, tt + tc / layers), abs=1e-12)
    assert p.end_s <= tc + tt + 1e-12 and len(p.pieces) == layers


def test_bigger_groups_never_end_sooner_and_one_group_is_the_whole_request_at_the_last_layer():
    ends = [plan_push(0.0, 0.4, 32, 3_200_000, 1e7, "layer", g).end_s for g in (1, 2, 4, 8, 16, 32)]
    assert ends == sorted(ends)
    whole = plan_push(0.0, 0.4, 32, 3_200_000, 1e7, "layer", 32)
    assert whole.pieces == ((0.4, pytest.approx(0.72), 3_200_000),)


def test_pieces_follow_each_other_on_the_lane_and_the_overlap_counts_what_left_before_the_prefill_ended():
    p = plan_push(0.0, 1.0, 10, 1000, rate_bytes_s=2000.0, granularity="layer", group=2)
    for (s0, e0, _), (s1, e1, _) in itertools.pairwise(p.pieces):
        assert s1 >= e0 and e1 > s1
    assert [s for s, _, _ in p.pieces] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # each group when computed
    assert p.sent_before(1.0) == 800  # four of five groups left while P computed


def test_group_bytes_add_up_exactly():
    for n, layers, g in [(0, 4, 1), (7, 4, 1), (1_000_003, 32, 5), (10, 3, 3)]:
        b = group_bytes(n, layers, g)
        assert sum(b) == n and len(b) == -(-layers // g)
        full = b[:-1] if layers % g else b  # the last group may hold fewer layers
        assert max(full) - min(full) <= g and b[-1] <= max(full)


def test_the_tail_after_the_last_layer_is_not_spread_over_the_layers():
    assert layer_done_times(0.0, 1.0, 4, tail_s=0.2) == pytest.approx([0.2, 0.4, 0.6, 0.8])


@pytest.mark.parametrize("kw,field", [(dict(layers=0), "layers"), (dict(group=0, granularity="layer"), "group"),
                                      (dict(granularity="chunky"), "granularity"), (dict(rate_bytes_s=0), "rate_bytes_s"),
                                      (dict(prefill_end_s=-1.0), "end_s"), (dict(tail_s=5.0), "tail_s")])
def test_bad_input_is_refused_naming_the_field(kw, field):
    args = dict(prefill_start_s=0.0, prefill_end_s=1.0, layers=4, nbytes=100, rate_bytes_s=10.0) | kw
    with pytest.raises(LayerPushError, match=field):
        plan_push(**args)
