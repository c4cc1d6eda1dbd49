"""The docs stay current: README and ARCHITECTURE short and free of run history, every
public name on the API page, every command-line flag on the command-line page, every page
in the site's navigation, every local link of the README pointing at a file.  (`make docs`
builds the site itself with --strict; this test needs no MkDocs.)"""
import re
from pathlib import Path

import flexflow as ff
from flexflow.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# sentences that narrate an earlier run instead of saying what the code does
HISTORY = re.compile(r"the run before|the day before|the previous run|used to be|\bwas\b[^.]*\bthen\b", re.I)


def test_readme_and_architecture_are_short_and_current():
    for name, most in (("README.md", 250), ("ARCHITECTURE.md", 400)):
        text = (ROOT / name).read_text()
        assert len(text.splitlines()) <= most, name
        assert not HISTORY.findall(text), (name, HISTORY.findall(text))


def test_every_public_name_is_on_the_api_page():
    api = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^::: flexflow\.(?:[\w.]+\.)?(\w+)$", api, re.M))
    assert set(ff.__all__) <= documented | {"models"}, set(ff.__all__) - documented
    assert "::: flexflow.models" in api


def test_every_command_and_flag_is_on_the_cli_page():
    page = (DOCS / "cli.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        assert f"`flexflow {name}" in page, name
        for action in p._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert flag in page, (name, flag)


def test_the_site_lists_every_page_and_every_link_resolves():
    nav = re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(nav) == pages
    for page in [ROOT / "README.md"] + [DOCS / p for p in pages]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith("http"):
                continue
            assert (page.parent / target).exists(), (page.name, target)
