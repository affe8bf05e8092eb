"""What the commands share to read and print sizes and tables."""

from __future__ import annotations

__all__ = ["human_bytes", "parse_bytes", "print_table"]


def parse_bytes(text: str) -> int:
    """A byte count as people write it: `1GiB`, `256MiB`, `512k`, `1048576`."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    """A right-aligned table (rich when installed, plain text otherwise)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for row in [headers, *rows]:
            print("  ".join(f"{c:>14}" for c in row))
        return
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    Console(width=max(Console().width, 110)).print(table)
