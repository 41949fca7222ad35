"""A throwaway certificate authority for tests: one CA and certificates it signed, each valid
for the given names and addresses (server and client use). The product's own, made with the
openssl command line (deploy/cluster_ca.py: `tandem launch` makes one per cluster)."""

from deploy.cluster_ca import EC, Issued, issue, make_ca

__all__ = ["EC", "Issued", "issue", "make_ca"]
