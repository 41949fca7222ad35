"""Capacity planning for a tandem cluster (`tandem plan`): a cost profile measured on a host
(cost_profile), request traces (trace), a discrete-event simulator of the cluster driven by
them (simulator, metrics), and a search over topologies for the cheapest one that meets an SLO
(search, topology_toml). Pure Python and torch-free: it imports nothing of tandem's, so the
planner runs anywhere, including on a laptop far from the cluster it sizes."""
