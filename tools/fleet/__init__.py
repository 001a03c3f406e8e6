"""Replicas behind a router: `stoker serve --replicas N --router smg` (docs/fleet.md)."""
