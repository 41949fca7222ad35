"""Launchers only: how tandem's processes get started.

    local.py         the supervisor: a topology as processes on this host, restarted on exit
    topology.py      topology TOML files -> a validated plan; hosts.py, probe.py check hosts
    launch.py        `tandem launch`: every role on its host (local, `ip netns exec`, SSH)
    remote.py        SSH command lines     ray_launcher.py   roles on a Ray cluster
    k8s/             Kubernetes manifests  *.toml, netns.sh  example topologies
"""
