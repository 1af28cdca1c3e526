"""The environment-variable table of the docs, built from the code's own names.

``scan(root)`` finds every ``HVDLITE_*``/``HOROVOD_*`` name the code quotes as a string
(native/, hvdlite/, setup.py, build_support/), leaving out the C API's enum constants,
and the Horovod aliases as the code pairs them (``("HOROVOD_X", "HVDLITE_Y", ...)`` in
the alias table, ``ReadSwitch("HVDLITE_Y", "HOROVOD_X", ...)`` in the core).
docs/_data/environment.yml holds what each variable means; ``render(root)`` fails when
the two disagree, so the table cannot drift from the code. Used by the MkDocs hook
(scripts/mkdocs_hooks.py) and by tests/unit/test_docs.py.
"""
import os
import re

SOURCES = ("native", "hvdlite", "build_support", "setup.py")
SUFFIXES = (".py", ".cc", ".h", ".c", ".cpp", ".hpp")
_QUOTED = re.compile(r"""["']((?:HVDLITE|HOROVOD)_[A-Z0-9_]+)["']""")
_PAIR = re.compile(r"""["']((?:HVDLITE|HOROVOD)_[A-Z0-9_]+)["']\s*,\s*["']((?:HVDLITE|HOROVOD)_[A-Z0-9_]+)["']""")
_ENUM = re.compile(r"^\s*(HVDLITE_[A-Z0-9_]+)\s*[=,]", re.M)


def _files(root):
    for source in SOURCES:
        path = os.path.join(root, source)
        if os.path.isfile(path):
            yield path
        for folder, _, names in os.walk(path):
            for name in sorted(names):
                if name.endswith(SUFFIXES):
                    yield os.path.join(folder, name)


def scan(root):
    """Returns (names, aliases): the set of variable names the code reads, and
    {HVDLITE name: [Horovod names]}."""
    with open(os.path.join(root, "native", "include", "hvdlite", "c_api.h")) as f:
        constants = set(_ENUM.findall(f.read()))
    names, aliases = set(), {}
    for path in _files(root):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        names.update(n for n in _QUOTED.findall(text)
                     if n not in constants and not n.startswith("HVDLITE_ERR_"))
        for a, b in _PAIR.findall(text):
            ours, theirs = (a, b) if a.startswith("HVDLITE_") else (b, a)
            if ours.startswith("HVDLITE_") and theirs.startswith("HOROVOD_"):
                aliases.setdefault(ours, [])
                if theirs not in aliases[ours]:
                    aliases[ours].append(theirs)
    return names, aliases


def load_descriptions(root):
    import yaml  # comes with MkDocs

    with open(os.path.join(root, "docs", "_data", "environment.yml")) as f:
        return yaml.safe_load(f)["groups"]


def check(root):
    """Returns a list of problems (empty when code and descriptions agree)."""
    names, aliases = scan(root)
    groups = load_descriptions(root)
    described = [n for g in groups for n in g["variables"]]
    problems = []
    ours = {n for n in names if n.startswith("HVDLITE_")}
    for n in sorted(ours - set(described)):
        problems.append(f"{n} is read by the code but not described in docs/_data/environment.yml")
    for n in sorted(set(described) - ours):
        problems.append(f"{n} is described in docs/_data/environment.yml but the code no longer reads it")
    for n in sorted({d for d in described if described.count(d) > 1}):
        problems.append(f"{n} is described twice in docs/_data/environment.yml")
    paired = {h for hs in aliases.values() for h in hs}
    for n in sorted({n for n in names if n.startswith("HOROVOD_")} - paired):
        problems.append(f"{n} is read by the code but paired with no HVDLITE_* variable")
    return problems


def render(root):
    """Returns the Markdown of the table; raises ValueError when the code and
    docs/_data/environment.yml disagree."""
    problems = check(root)
    if problems:
        raise ValueError("environment table out of date:\n  " + "\n  ".join(problems))
    _, aliases = scan(root)
    out = []
    for group in load_descriptions(root):
        out += [f"### {group['title']}", "",
                "| variable | Horovod's name | launcher flag | default | meaning |",
                "|---|---|---|---|---|"]
        for name, info in group["variables"].items():
            horovod = ", ".join(f"`{h}`" for h in aliases.get(name, ()))
            flag = f"`{info['flag']}`" if info.get("flag") else ""
            out.append(f"| `{name}` | {horovod} | {flag} | {info.get('default', '')} | "
                       f"{info['meaning']} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
