"""Service directory: etcd (leases, consistent hashing over cache-tier members) or in-process."""

from hybridcache.services.directory.base import Directory, HashRing
from hybridcache.services.directory.etcd import EtcdDirectory, make_directory
from hybridcache.services.directory.memory import InProcessDirectory

__all__ = ["Directory", "EtcdDirectory", "HashRing", "InProcessDirectory", "make_directory"]
