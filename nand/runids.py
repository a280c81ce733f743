"""Run ids: the one rule every part checks, and how other names are made into one.

A run id is one path segment of the REST API (``/api/runs/{run}``) and one
value of the database's ``runs.name`` column, so it is

- 1 to :data:`MAX_RUN_CHARS` characters, each one UTF-8 can encode, no NUL;
- without ``/``, and neither ``.`` nor ``..`` (a path step, never addressable).

Anything else is allowed (``a b``, ``é-run``, ``50%``, ``a?b#c``: clients
encode the segment). :func:`run_problem` says why a string breaks the rule
(:func:`run_flaw`, the flaw alone, for the CLI's own sentence);
the agent's settings (``run=``, ``NAND_RUN``), the server's admission
(``bad_run``), its REST routes and the CLI all ask it, so they cannot disagree.

A name not chosen for nand (a framework's run name such as Lightning's
``lightning_logs/0``, a launcher's id) becomes a run id through
:func:`run_id_from`, the same on every rank because it depends on the name only.

This module imports nothing heavy: the agent, the server and the CLI share it.
"""

from __future__ import annotations

#: The longest run id (the ``runs.name`` column is ``String(256)``).
MAX_RUN_CHARS = 256
#: Path steps: an id equal to one of these can be stored but never addressed.
PATH_STEPS = (".", "..")
#: What :func:`run_id_from` puts in place of a character a run id cannot have.
REPLACEMENT = "-"
#: The rule in words, for messages.
RULE = f"1 to {MAX_RUN_CHARS} characters, no '/' or NUL, neither '.' nor '..'"


def run_problem(run: str) -> str | None:
    """Why ``run`` cannot be a run id, or None if it can.

    >>> run_problem("llama-7b.exp3"), run_problem("a<b c")
    (None, None)
    >>> run_problem("team/exp3")
    "run id 'team/exp3' contains '/'; use another character, e.g. 'team-exp3'"
    """
    flaw = run_flaw(run)
    if flaw is None:
        return None
    shown = shown_id(run)
    if flaw.startswith("contains"):
        return f"run id {shown} {flaw}; use another character, e.g. {run_id_from(run)!r}"
    if flaw.startswith("has"):
        return f"run id {shown} {flaw}; shorten it"
    return f"run id {shown} {flaw}; name the run"


def run_flaw(run: str) -> str | None:
    """What keeps ``run`` from being a run id, to follow "it" or the id; None if nothing.

    >>> run_flaw("lightning_logs/0"), run_flaw(".."), run_flaw("ok")
    ("contains '/'", "is a path step ('.' or '..')", None)
    """
    if not run:
        return "is empty"
    if len(run) > MAX_RUN_CHARS:
        return f"has {len(run)} characters, more than {MAX_RUN_CHARS}"
    if run in PATH_STEPS:
        return "is a path step ('.' or '..')"
    bad = next((ch for ch in run if not _allowed(ch)), None)
    return None if bad is None else f"contains {bad!r}"


def shown_id(run: str) -> str:
    """``run`` quoted for a message, cut if long."""
    return repr(run) if len(run) <= 80 else f"{run[:40]!r}..."


def run_id_from(name: str) -> str | None:
    """``name`` made a run id, or None if nothing of it can name a run.

    Each character a run id cannot have (``/``, NUL, one UTF-8 cannot encode)
    becomes ``-``, and the result is cut to :data:`MAX_RUN_CHARS`; an empty
    name, ``.`` or ``..`` gives None. An id that keeps the rule is unchanged.

    >>> run_id_from("lightning_logs/0"), run_id_from("sweep/lr=3e-4/seed 1")
    ('lightning_logs-0', 'sweep-lr=3e-4-seed 1')
    >>> run_id_from("my-run"), run_id_from("."), run_id_from("")
    ('my-run', None, None)
    """
    made = "".join(ch if _allowed(ch) else REPLACEMENT for ch in name)[:MAX_RUN_CHARS]
    if not made or made in PATH_STEPS:
        return None
    return made


def _allowed(ch: str) -> bool:
    """Whether one character may be in a run id (``/`` and NUL may not, nor a
    lone surrogate, which an environment variable of undecodable bytes holds)."""
    return ch not in "/\x00" and not "\ud800" <= ch <= "\udfff"
