"""The key reference of docs/config.md, generated from the config dataclasses so it cannot drift.

``python -m hybridflow.trainers.config.docs`` rewrites the generated part of docs/config.md (between
the BEGIN/END markers); ``tests/test_config_docs.py`` fails when the file is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hybridflow.trainers.config.loader import config_reference

BEGIN = "<!-- BEGIN GENERATED KEY REFERENCE: python -m hybridflow.trainers.config.docs -->"
END = "<!-- END GENERATED KEY REFERENCE -->"
DOC_PATH = Path(__file__).resolve().parents[3] / "docs" / "config.md"


def _table(title: str, cls, note: str) -> str:
    lines = [f"### {title}", "", note, "", "| key | type | default | meaning |", "|---|---|---|---|"]
    for row in config_reference(cls):
        cells = [f"`{row['key']}`", row["type"].replace("|", "\\|"), f"`{row['default']}`",
                 row["doc"].replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_reference() -> str:
    """The generated markdown: one table per command's config, every leaf key with its type and default."""
    from hybridflow.trainers.config.rl import RLConfig
    from hybridflow.trainers.supervised import RMConfig, SFTConfig

    parts = [
        _table("`hybridflow train` (RLConfig)", RLConfig,
               "Every key a YAML file or a `key=value` override may set; what the trainer derives from them "
               "(samples per step, mini-batches per epoch, data-parallel sizes) is printed by `--print-config`, never "
               "a key."),
        _table("`hybridflow sft` (SFTConfig)", SFTConfig, "The same `model` and `engine` sections as a role above."),
        _table("`hybridflow rm` (RMConfig)", RMConfig, "The same `model` and `engine` sections as a role above."),
    ]
    return "\n\n".join([BEGIN, *parts, END])


def with_reference(text: str) -> str:
    """``text`` (docs/config.md) with its generated part replaced by the current reference."""
    if BEGIN not in text or END not in text:
        return text.rstrip("\n") + "\n\n## Every key\n\n" + render_reference() + "\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + render_reference() + tail


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Regenerate the key reference of docs/config.md from the "
                                                 "config dataclasses.")
    parser.add_argument("path", nargs="?", default=str(DOC_PATH), help="the Markdown file to update in place")
    path = Path(parser.parse_args(argv).path)
    path.write_text(with_reference(path.read_text()))
    print(f"wrote the key reference into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
