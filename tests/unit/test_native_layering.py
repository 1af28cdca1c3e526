"""The native core's includes point only down its layers (native/src/README.md).

Each folder of native/src is a layer; the order is the bulleted list at the top of
native/src/README.md. A file may include its own layer or one below it, never one
above, and every file lives in a folder of that list.
"""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "native", "src")
INCLUDE = os.path.join(ROOT, "native", "include")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_order(readme_text):
    """Returns the layers, bottom first, from README's "- `name/` — ..." lines."""
    order = []
    for line in readme_text.splitlines():
        match = re.match(r"^- `([a-z_]+)/`", line)
        if match:
            order.append(match.group(1))
    return order


def layer_of(path):
    """native/include/... -> "include"; native/src/<folder>/... -> folder; root -> None."""
    rel = os.path.relpath(path, ROOT).split(os.sep)
    if rel[:2] == ["native", "include"]:
        return "include"
    return rel[2] if len(rel) > 3 else None


def sources():
    for top in (SRC, INCLUDE):
        for dirpath, _, names in os.walk(top):
            for name in sorted(names):
                if name.endswith((".h", ".cc")):
                    yield os.path.join(dirpath, name)


def resolve(include):
    """The file an include names: under native/src, else native/include."""
    for top in (SRC, INCLUDE):
        path = os.path.join(top, include)
        if os.path.exists(path):
            return path
    return None


def violations(order):
    rank = {name: i for i, name in enumerate(order)}
    found = []
    for path in sources():
        rel = os.path.relpath(path, ROOT)
        layer = layer_of(path)
        if layer not in rank:
            found.append(f"{rel}: in {'native/src itself' if layer is None else 'folder ' + layer + '/'}, "
                         f"which is not a layer of native/src/README.md ({', '.join(order)})")
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for include in INCLUDE_RE.findall(text):
            target = resolve(include)
            if target is None:
                found.append(f'{rel}: #include "{include}" names no file under native/src or '
                             "native/include (includes are paths under native/src)")
                continue
            to = layer_of(target)
            if to not in rank:
                continue  # reported as a misplaced file on its own
            if rank[to] > rank[layer]:
                found.append(f'{rel}: #include "{include}" points up, from layer {layer} '
                             f"to layer {to}")
    return found


def test_layer_order_is_written_down():
    with open(os.path.join(SRC, "README.md"), encoding="utf-8") as f:
        order = layer_order(f.read())
    assert order[0] == "include" and len(order) == len(set(order)) >= 3, order


def test_includes_point_down_the_layers():
    with open(os.path.join(SRC, "README.md"), encoding="utf-8") as f:
        order = layer_order(f.read())
    found = violations(order)
    assert not found, "native includes against the layering:\n  " + "\n  ".join(found)


def test_checker_sees_an_upward_include():
    # The same files against the order turned upside down (api at the bottom): every
    # include between two folders then points up, so the checker must report some.
    with open(os.path.join(SRC, "README.md"), encoding="utf-8") as f:
        order = layer_order(f.read())
    reversed_order = ["include"] + order[1:][::-1]
    found = violations(reversed_order)
    assert any("points up, from layer api to layer core" in v for v in found), found[:5]
