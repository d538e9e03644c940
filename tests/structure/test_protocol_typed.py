"""Every control-plane and data-plane message is built and read in ``nonstop/protocol/`` only
(issue 46, item 3): outside that package no code writes a message as a dict literal or reads a
received message's field by its string key; senders call ``SomethingMsg(...).encode()`` and
receivers ``decode_...(raw)`` / ``SomethingMsg.decode(raw)``.

What counts (an AST walk of every ``nonstop/**/*.py`` outside ``nonstop/protocol/``):

- a *message literal*: a dict display with the key ``"t"`` whose value is a string constant (the
  kind, e.g. ``{"t": "hb", ...}``). A ``"t"`` that is not a string constant (``"t": time.time()``
  in demo/samples.py, a timestamp) is not a message;
- a *string-keyed message access*: ``X["field"]`` (read or write) or ``X.get("field", ...)`` where
  ``X`` is a name or attribute spelled as one of :data:`MESSAGE_NAMES` -- the names the code gives
  a message it received or is about to send (``msg``, ``reply``, ``welcome``, ``head``, ``ack``,
  ``first``, ``reconfigure``, ``hello``, ``ask``, ``now``). Data that is not a message (event
  ``detail`` dicts, JSON files, marks) is not counted, whatever its keys.

:data:`REMAINING` lists the files not yet converted, with their exact counts (literals, accesses):
the test fails when a file outside it has any, and when a listed file's counts change (lower them
as a channel is converted; a file at zero leaves the list). The goal is an empty list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nonstop

SOURCE = Path(nonstop.__file__).parent
PROTOCOL = SOURCE / "protocol"

MESSAGE_NAMES = frozenset(
    {"msg", "reply", "welcome", "head", "ack", "first", "reconfigure", "hello", "ask", "now"}
)

# files whose dicts under those names are not messages of nonstop's channels
NOT_MESSAGES = {
    "checkpoint/reader.py": "first: the first rank's state dict",
    "train/rescue.py": "head: a snapshot's head (the bytes' metadata), not a wire message",
    "control/etcdwatch.py": "msg: etcd's JSON gateway answers, etcd's protocol",
    "control/channel.py": "the handshake below the frames (its own format, documented there)",
}

# file (relative to nonstop/) -> (message literals, string-keyed message accesses) still there
REMAINING: dict[str, tuple[int, int]] = {}


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def count(path: Path) -> tuple[int, int]:
    """(message literals, string-keyed message accesses) in one source file."""
    literals = accesses = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Dict) and any(
            isinstance(k, ast.Constant)
            and k.value == "t"
            and isinstance(v, ast.Constant)
            and isinstance(v.value, str)
            for k, v in zip(node.keys, node.values, strict=True)
        ):
            literals += 1
        base: ast.expr | None = None
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
        ):
            base = node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            base = node.func.value
        if base is not None and _name(base) in MESSAGE_NAMES:
            accesses += 1
    return literals, accesses


def counts() -> dict[str, tuple[int, int]]:
    out = {}
    for p in sorted(SOURCE.rglob("*.py")):
        if p.is_relative_to(PROTOCOL) or str(p.relative_to(SOURCE)) in NOT_MESSAGES:
            continue
        c = count(p)
        if c != (0, 0):
            out[str(p.relative_to(SOURCE))] = c
    return out


def test_messages_are_built_and_read_only_in_the_protocol_package() -> None:
    assert counts() == REMAINING


def test_the_counter_sees_what_it_should() -> None:
    import tempfile

    src = (
        "def f(msg, ch):\n"
        '    ch.send({"t": "hb", "coll": True})\n'  # a message literal
        '    x = {"t": 1.5}\n'  # not one: "t" is a timestamp
        '    a = msg["gen"]\n'  # a read
        '    b = msg.get("step", 0)\n'  # a read
        '    msg["rank"] = 3\n'  # a write
        '    c = detail["gen"]\n'  # not a message name
    )
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.py"
        p.write_text(src)
        assert count(p) == (1, 3)
