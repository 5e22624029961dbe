"""Every word the agent emits is in moewatch.vocabulary, and the catalogue and exporters list them all.

The check is static: every string literal that reaches the counting function (`_count`), a
`Decision(...)` or the policy's `skip(...)` is read from the agent's source, so a path no test walks
is checked too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from moewatch import telemetry as tm
from moewatch import triage, vocabulary as vocab
from moewatch.agent import catalog, policy
from moewatch.agent.metrics import actions

AGENT = Path(policy.__file__).parent


def _literals(node: ast.AST) -> set[str]:
    """String constants an argument can evaluate to: itself, either branch of a conditional, an
    element of a list or tuple, or an argument of a call such as next(..., default); a condition's
    own test is not a value."""
    if isinstance(node, ast.Constant):
        return {node.value} if isinstance(node.value, str) else set()
    if isinstance(node, ast.IfExp):
        return _literals(node.body) | _literals(node.orelse)
    if isinstance(node, ast.BoolOp):
        return set().union(*(_literals(v) for v in node.values))
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return set().union(set(), *(_literals(e) for e in node.elts))
    if isinstance(node, ast.Call):
        return set().union(set(), *(_literals(a) for a in node.args))
    if isinstance(node, (ast.GeneratorExp, ast.ListComp)):
        return _literals(node.elt)
    return set()  # a name or attribute: its literal is checked where it was written


def _calls(name: str) -> list[tuple[str, ast.Call]]:
    found = []
    for path in sorted(AGENT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called == name:
                    found.append((f"{path.name}:{node.lineno}", node))
    return found


def _arg(call: ast.Call, index: int) -> ast.AST | None:
    return call.args[index] if len(call.args) > index else None


def test_every_counted_kind_and_result_is_in_the_vocabulary():
    counted = _calls("_count")
    assert len(counted) >= 6, "the counting calls were not found: the check would pass on nothing"
    kinds, results = set(), set()
    for where, call in counted:
        if _arg(call, 1) is None:
            continue  # the definition's own signature is not a call
        kinds |= {(where, k) for k in _literals(call.args[1])}
        results |= {(where, r) for r in _literals(call.args[2])}
    assert {r for _, r in results} >= {"applied", "failed", "abandoned", "rolled_back"}
    assert [(w, k) for w, k in kinds if k not in vocab.DECISION_KINDS] == []
    assert [(w, r) for w, r in results if r not in vocab.COUNTED_RESULTS] == []


def test_every_decision_kind_and_result_is_in_the_vocabulary():
    decisions = _calls("Decision")
    assert len(decisions) >= 10
    bad = []
    for where, call in decisions:
        bad += [(where, k) for k in _literals(call.args[0]) if k not in vocab.DECISION_KINDS]
        bad += [(where, r) for r in _literals(call.args[2]) if r not in vocab.DECISION_RESULTS]
    for where, call in _calls("skip"):
        bad += [(where, k) for k in _literals(call.args[0]) if k not in vocab.DECISION_KINDS]
    assert bad == []


ACTION_FAMILIES = {"ACTIONS_TOTAL": "moewatch_actions_total", "ROLLBACKS_TOTAL": "moewatch_rollbacks_total"}


def _moves_action_counter(call: ast.Call) -> bool:
    """`state[ACTIONS_TOTAL].inc(labels, n)` (a typed family) or `state.inc("moewatch_actions_total", ...)`
    (by name), with an n that is not the 0 every series starts at."""
    receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
    if isinstance(receiver, ast.Subscript) and getattr(receiver.slice, "id", None) in ACTION_FAMILIES:
        count = _arg(call, 1)
    elif call.args and _literals(call.args[0]) & set(ACTION_FAMILIES.values()):
        count = _arg(call, 2)
    else:
        return False
    return not (isinstance(count, ast.Constant) and count.value == 0)


def test_only_the_counting_function_moves_the_action_counters():
    moved = [(where, call) for where, call in _calls("inc") if _moves_action_counter(call)]
    assert [w for w, _ in moved if not w.startswith("controller.py")] == []
    assert len(moved) == 2  # actions_total, and rollbacks_total derived from it, both inside _count


def test_catalogue_and_exporters_list_every_counted_value():
    # Every (kind, result) the agent counts starts at 0 and is named in the family's help.
    assert set(actions.ACTION_KINDS) == set(vocab.DECISION_KINDS)
    assert set(actions.ACTION_RESULTS) == set(vocab.COUNTED_RESULTS)
    help_text = catalog.BY_NAME["moewatch_actions_total"].help
    assert all(k in help_text for k in vocab.DECISION_KINDS)
    assert all(r in help_text for r in vocab.COUNTED_RESULTS)
    assert policy.KINDS == vocab.DECISION_KINDS


def test_the_core_speaks_the_same_words():
    assert triage.VERDICTS == vocab.VERDICTS and triage.CAUSES == vocab.CAUSES
    assert tm.EVIDENCE_KINDS == vocab.EVIDENCE_KINDS and tuple(tm.EVIDENCE) == vocab.EVIDENCE_KINDS[:-1]
    for colours in (vocab.TERMINAL_COLOURS, vocab.HEX_COLOURS, vocab.GRAFANA_COLOURS):
        assert tuple(colours) == vocab.VERDICTS


def test_the_agent_docs_list_every_result_and_kind():
    text = (AGENT.parent / "docs" / "agent.md").read_text()
    table = {line.split("|")[1].strip().strip("`") for line in text.splitlines()
             if line.startswith("| `") and line.count("|") == 3}
    assert set(vocab.DECISION_RESULTS) <= table
    kinds_line = next(line for line in text.splitlines() if line.startswith("Kinds: "))
    assert [k.strip(" `.") for k in kinds_line[len("Kinds: "):].split(",")] == list(vocab.DECISION_KINDS)
