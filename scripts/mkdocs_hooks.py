"""MkDocs hooks: pages generated from the code when the site is built.

* ``<!-- generated: environment -->``: the table of every environment variable
  (scripts/docs_env.py; the build fails when the code and the descriptions disagree).
* ``<!-- generated: hvdliterun-help -->``: ``hvdliterun --help``, from its argparse parser.
* ``<!-- generated: api MODULE -->``: the API reference of a public module: one
  mkdocstrings entry per name of its ``__all__``, found where it is defined at build time
  (the pages name only the public module, so moving code between files needs no edit).
* troubleshooting.md must have a section for every exception class of ``hvdlite.errors``.
"""
import importlib.util
import inspect
import logging
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _docs_env():
    spec = importlib.util.spec_from_file_location("docs_env", os.path.join(ROOT, "scripts", "docs_env.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _DocstringLayoutFilter(logging.Filter):
    """Drops griffe's notes on docstring sections it cannot split into 'name:
    description' pairs (e.g. "Raises: As ``allreduce``."): the text is still shown as
    written. Every other warning still fails the strict build."""

    def filter(self, record):
        return "Failed to get '" not in record.getMessage()


def on_startup(command, dirty):
    for name in ("griffe", "mkdocs.plugins.griffe", "mkdocs.plugins.mkdocstrings_handlers"):
        logging.getLogger(name).addFilter(_DocstringLayoutFilter())


def _launcher_help():
    env = dict(os.environ, COLUMNS="100", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "hvdlite.runner", "--help"], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True)
    return "```text\n" + out.stdout.rstrip() + "\n```"


def error_classes():
    """The exception classes hvdlite.errors defines, in the order it defines them."""
    import hvdlite.errors as errors

    return [c for _, c in inspect.getmembers(errors, inspect.isclass)
            if issubclass(c, BaseException) and c.__module__ == errors.__name__]


def api_entries(module_name):
    """Markdown for the public names of ``module_name``: mkdocstrings entries for the
    functions and classes, a list of the other values."""
    import importlib
    import types

    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    blocks, values = [], []
    for name in names:
        obj = getattr(module, name)
        if getattr(obj, "__module__", None) == "hvdlite.errors" and module_name != "hvdlite.errors":
            # Documented once, on the errors page; autorefs wants one home per object.
            values.append(f"- `{name}`: [`hvdlite.errors.{obj.__name__}`](errors.md)")
            continue
        if isinstance(obj, types.ModuleType):
            values.append(f"- `{name}`: the module `{obj.__name__}`")
            continue
        home = getattr(obj, "__module__", None) or ""
        qualname = getattr(obj, "__qualname__", None)
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and home.startswith("hvdlite") \
                and qualname and "<" not in qualname:
            blocks.append(f"::: {home}.{qualname}\n    options:\n      show_root_heading: true\n"
                          f"      show_root_full_path: false\n      heading_level: 2\n")
        else:
            values.append(f"- `{name}`: `{type(obj).__name__}`")
    text = "\n".join(blocks)
    if values:
        text += "\n## Other names\n\n" + "\n".join(values) + "\n"
    return text


def on_page_markdown(markdown, page, config, files):
    if "<!-- generated: environment -->" in markdown:
        markdown = markdown.replace("<!-- generated: environment -->", _docs_env().render(ROOT))
    if "<!-- generated: hvdliterun-help -->" in markdown:
        markdown = markdown.replace("<!-- generated: hvdliterun-help -->", _launcher_help())
    marker = "<!-- generated: api "
    if marker in markdown:
        start = markdown.index(marker)
        end = markdown.index("-->", start) + 3
        module_name = markdown[start + len(marker):end - 3].strip()
        markdown = markdown[:start] + api_entries(module_name) + markdown[end:]
    if page.file.src_uri == "troubleshooting.md":
        missing = [c.__name__ for c in error_classes() if f"## `{c.__name__}`" not in markdown]
        if missing:
            raise ValueError("troubleshooting.md has no section for " + ", ".join(missing))
    return markdown
