"""Per-window cost, by construction rather than by the clock: the exposition is prometheus_client's text
byte for byte, rendered per (family, group) only when that chunk changed; a group's memory is
bounded by history_bytes."""

from __future__ import annotations

from prometheus_client import generate_latest

from moewatch.agent.exporters import make_registry, render
from moewatch.agent.metrics.connections import FRAMES_REJECTED_TOTAL
from moewatch.agent.metrics.groups import init_group
from moewatch.agent.metrics.identity import init_static
from moewatch.agent.metrics.state import MetricsState
from moewatch.agent.metrics.windows import LAYER_RANK_LOAD_MAX_MIN, GroupExportMemory, record_window
from moewatch.agent.store import GroupStore, TriagedWindow
from moewatch.tools.examples import SCENARIOS, partial_example, simulate
from moewatch.triage import diagnose


def populated():
    state = MetricsState(expert_series_cap=30)
    registry = make_registry(state)
    init_static(state, "observe")
    memories = {}
    for i, (name, model) in enumerate([("imbalance-hot-experts", "a"), ("overflow", "b"), ("healthy", "a")]):
        w = simulate(SCENARIOS[name], seed=i, start_time=1000.0 + 10 * i).replace(model=model)
        init_group(state, (w.model, w.ep_group))
        record_window(state, memories.setdefault(model, GroupExportMemory()), w, diagnose(w), expert_metrics=True)
    w = partial_example("logical-only-hot-experts").replace(model="c")
    record_window(state, GroupExportMemory(), w, diagnose(w), expert_metrics=False)
    # Label values that need escaping, and an infinite value.
    state[FRAMES_REJECTED_TOTAL].inc(('odd "reason"\\with\nnewline',))
    state[LAYER_RANK_LOAD_MAX_MIN].set(("a", "example", "9"), float("inf"))
    return state, registry, memories


def test_cached_exposition_is_prometheus_clients_text_byte_for_byte():
    state, registry, memories = populated()
    assert render(registry) == generate_latest(registry)
    state[LAYER_RANK_LOAD_MAX_MIN].remove(("a", "example", "9"))
    state.remove_group(("b", "example"))
    text = render(registry)
    assert text == generate_latest(registry)
    assert b'model="b"' not in text and b'model="a"' in text


def test_a_window_rerenders_only_its_own_group_and_a_quiet_scrape_renders_nothing():
    state, registry, memories = populated()
    exposition = registry.exposition
    render(registry)
    before = dict(exposition._chunks)
    assert render(registry) == render(registry)
    assert all(exposition._chunks[k] is v for k, v in before.items())  # nothing changed: nothing rendered
    # A window of group "a": recorded, rendered once as part of recording, then served as is.
    w = simulate(SCENARIOS["healthy"], seed=9, start_time=5000.0).replace(model="a")
    record_window(state, memories["a"], w, diagnose(w), expert_metrics=True)
    after_window = dict(exposition._chunks)
    changed = {k for k in before if after_window.get(k) is not before[k]}
    assert changed and {chunk for _, chunk in changed} == {("a", "example")}
    render(registry)
    assert all(exposition._chunks[k] is v for k, v in after_window.items())
    assert render(registry) == generate_latest(registry)


def test_a_quiet_scrape_copies_the_kept_bytes_and_every_change_shows():
    state, registry, memories = populated()
    first = render(registry)
    assert render(registry) is first  # nothing changed since: no chunk walk, no join
    for change in (lambda: state[FRAMES_REJECTED_TOTAL].inc(("bad_magic",)),
                   lambda: state[LAYER_RANK_LOAD_MAX_MIN].set(("a", "example", "9"), 2.5),
                   lambda: state[LAYER_RANK_LOAD_MAX_MIN].remove(("a", "example", "9")),
                   lambda: state.remove_group(("b", "example"))):
        before = render(registry)
        change()
        text = render(registry)
        assert text != before and text == generate_latest(registry)
    state[LAYER_RANK_LOAD_MAX_MIN].set(("a", "example", "8"), 1.0)
    kept = render(registry)
    state[LAYER_RANK_LOAD_MAX_MIN].set(("a", "example", "8"), 1.0)  # the same value: nothing to re-render
    assert render(registry) is kept


def test_a_groups_history_and_backlog_are_bounded_by_bytes():
    w = simulate(SCENARIOS["healthy"], seed=1)
    size = w.nbytes
    assert size == sum(getattr(w, n).nbytes for n in w.__dataclass_fields__ if hasattr(getattr(w, n), "nbytes"))
    group = GroupStore(("m", "g"), history_windows=100, history_bytes=int(3.5 * size))
    d = diagnose(w)
    for i in range(10):
        group.add_triaged(TriagedWindow(w.replace(start_time=i, end_time=i + 1.0), d, 0.0))
    assert len(group.history) == 3 and group.history_nbytes == 3 * size
    assert [t.window.start_time for t in group.history] == [7.0, 8.0, 9.0]
    # The backlog: the first window always fits, then the byte bound refuses more.
    from moewatch.wire import Hello

    group.on_hello(Hello(runtime="x", model="m", ep_group="g", world_size=w.world_size, num_layers=w.num_layers,
                         num_experts=w.num_experts, num_slots=w.num_slots, epoch=0), 1)
    reasons = [group.accept_window(w.replace(start_time=100.0 + i, end_time=101.0 + i)) for i in range(5)]
    assert reasons == [None, None, None, "backlog", "backlog"]
    # One budget: the waiting windows pushed out all of the history but its newest window.
    assert [t.window.start_time for t in group.history] == [9.0]
    assert group.history_nbytes + group.untriaged_nbytes == 4 * size
    assert len(group.take_untriaged()) == 3 and group.untriaged_nbytes == 0
    assert group.accept_window(w.replace(start_time=200.0, end_time=201.0)) is None
