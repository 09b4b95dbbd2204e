"""The job store's parts: the database (SQLite or PostgreSQL, one SQL), its versioned schema, leases
among the stores on one database, and artifact storage (a shared folder or an S3 bucket)."""

from fv_core.serving.store.db import Database
from fv_core.serving.store.leases import LEASE_S, Lease
from fv_core.serving.store.migrations import VERSION, migrate
from fv_core.serving.store.storage import FolderStorage, S3Storage, Storage, open_storage

__all__ = [
    "LEASE_S",
    "VERSION",
    "Database",
    "FolderStorage",
    "Lease",
    "S3Storage",
    "Storage",
    "migrate",
    "open_storage",
]
