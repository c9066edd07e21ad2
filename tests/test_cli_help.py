"""The CLI as users of `openstack`, `gh` and `sky` expect it (issue 61): verbs grouped by purpose with their whole
first sentence, every --json documented, exit codes said once, and no verb one letter from another."""

import click
from click.testing import CliRunner

from appliance.cli import SECTIONS, main


def _commands(group, prefix=()):
    for name, cmd in group.commands.items():
        yield prefix + (name,), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, prefix + (name,))


def test_help_groups_every_verb_once_and_says_the_exit_codes():
    out = CliRunner().invoke(main, ["--help"], terminal_width=200).output
    shown = [n for n, c in main.commands.items() if not c.hidden]
    listed = [n for _, names in SECTIONS for n in names]
    assert len(listed) == len(set(listed))
    for title, names in SECTIONS:
        assert f"{title}:" in out
    for n in shown:
        assert sum(line.split()[:1] == [n] for line in out.splitlines()) == 1, n
    assert "..." not in out.split("Before a lease:")[1]  # summaries are whole sentences, not cut at 45 characters
    assert "Exit codes: 0 done" in out and "75" in out


def test_every_json_option_is_documented():
    missing = [" ".join(path) for path, cmd in _commands(main)
               for p in cmd.params if "--json" in getattr(p, "opts", ()) and not p.help]
    assert not missing, f"--json without help: {missing}"


def test_every_verb_has_json():
    """Every verb prints its result as JSON with --json (issue 76 point 4: `lease delete` and `cloud stop` had
    none); `logs --json` refuses only --follow."""
    verbs = {path for path, cmd in _commands(main) if not isinstance(cmd, click.Group)}
    has = {path for path, cmd in _commands(main) if any("--json" in getattr(p, "opts", ()) for p in cmd.params)}
    assert verbs - has == set(), sorted(verbs - has)


def test_no_two_verbs_differ_by_one_letter():
    names = [n for n, c in main.commands.items() if not c.hidden]

    def one_apart(a, b):
        if abs(len(a) - len(b)) > 1 or a == b:
            return False
        if len(a) == len(b):
            return sum(x != y for x, y in zip(a, b)) == 1
        short, long_ = sorted((a, b), key=len)
        return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))

    assert not [(a, b) for a in names for b in names if a < b and one_apart(a, b)]


def test_runs_is_still_understood_but_not_listed():
    r = CliRunner().invoke(main, ["runs", "--help"])
    assert r.exit_code == 0 and "List runs" in r.output
    assert main.commands["runs"].hidden and not main.commands["ls"].hidden
