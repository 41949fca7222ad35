"""Whether an address a process listens on is reachable from other hosts."""

from __future__ import annotations

import ipaddress


def is_loopback(address: str) -> bool:
    """localhost and 127.0.0.0/8, ::1; host names other than localhost are not."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
