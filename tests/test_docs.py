"""The README and docs/ render as plain Markdown on a forge: every relative link reaches a file, and every
#anchor a heading of that file (GitHub's slugs), so a page moved or renamed is caught here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not '-' or '_'), spaces as '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.*)", line)):
            found.add(slug(m.group(1)))
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not t.startswith(("http://", "https://", "mailto:"))]


def test_every_link_between_pages_resolves():
    broken = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: depth belongs in docs/"
    assert "make demo" in lines[12] or any(line.startswith("make demo") for line in lines[:20])


def test_slugs_follow_github():
    assert slug("`gpuwise devices` — what is here") == "gpuwise-devices--what-is-here"
    assert slug("`--json` schema of `gpuwise plan`") == "--json-schema-of-gpuwise-plan"


def test_the_readme_s_json_promise_holds_for_every_command():
    """The README's "every one but `chat`, `ui`, `schema` and `runs show` has `--json`", against each command's
    options as the CLI declares them."""
    import typer

    from gpuwise.cli.app import app

    def commands(c, prefix=()):
        subs = getattr(c, "commands", None)
        if subs is None:
            yield " ".join(prefix), c
        for name, sub in (subs or {}).items():
            yield from commands(sub, (*prefix, name))

    readme = (ROOT / "README.md").read_text()
    said = "every one but `chat` (a conversation), `ui` (a web app), `schema` and `runs show` (JSON always)"
    assert f"{said} has `--json`" in " ".join(readme.split())
    found = dict(commands(typer.main.get_command(app)))
    assert {"chat", "ui", "serve", "report", "plan", "runs show"} <= set(found)
    for name, command in found.items():
        has = any("--json" in getattr(p, "opts", ()) for p in command.params)
        assert has == (name not in ("chat", "ui", "schema", "runs show")), name
