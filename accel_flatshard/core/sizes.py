"""Sizes people type, in bytes: :func:`parse_size` (``"80GiB"``, ``"5GB"``, ``"1e9"``) for the command lines and the
planner's ``--device_memory``, consolidate's ``max_shard_size``."""
from __future__ import annotations

import re
from typing import Union



def parse_size(size: Union[int, str], name: str = "size") -> int:
    """``"5GB"`` -> 5 * 10^9, ``"500MiB"`` or ``"80G"`` -> binary multiples, ``"1e9"`` or ``123`` -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.e+]+)\s*([KMGT]?)(i?)(B?)\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse {name} {size!r}: expected a size such as 80GiB, 5GB, 500MiB or a number of "
                         "bytes")
    number, prefix, binary, b = m.groups()
    power = "KMGT".index(prefix.upper()) + 1 if prefix else 0
    return int(float(number) * (1000 if b and not binary else 1024) ** power)
