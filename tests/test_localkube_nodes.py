"""The local plane's nodes: names, zones, per-node paths; which pods get a token."""

from __future__ import annotations

import pytest
from kubernetes import client

from harness.localkube.plane import PlaneNode, is_kubelet, plane_nodes
from harness.localkube.podspec import wants_token


def test_one_node_keeps_the_single_node_names() -> None:
    assert plane_nodes(1) == [PlaneNode("localkube", "zone-a", "kubelet")]
    node = plane_nodes(1)[0]
    assert node.pod_logs == "pods" and node.client == "node-localkube"


def test_several_nodes_get_letters_and_zones_round_robin() -> None:
    nodes = plane_nodes(4)
    assert [n.name for n in nodes] == [f"localkube-{x}" for x in "abcd"]
    assert [n.zone for n in nodes] == ["zone-a", "zone-b", "zone-c", "zone-a"]
    assert [n.component for n in nodes] == [f"kubelet-{x}" for x in "abcd"]
    assert [n.pod_logs for n in nodes] == [f"pods-{x}" for x in "abcd"]
    assert all(is_kubelet(n.component) for n in nodes)
    assert not is_kubelet("kube-scheduler") and not is_kubelet("kubelets")


@pytest.mark.parametrize("count", [0, 10])
def test_node_counts_out_of_range_are_refused(count: int) -> None:
    with pytest.raises(ValueError, match="between 1 and 9"):
        plane_nodes(count)


def _pod(*sources: client.V1VolumeProjection) -> client.V1Pod:
    volumes = [client.V1Volume(name="data", empty_dir=client.V1EmptyDirVolumeSource())]
    if sources:
        projected = client.V1ProjectedVolumeSource(sources=list(sources))
        volumes.append(client.V1Volume(name="kube-api-access-x", projected=projected))
    return client.V1Pod(spec=client.V1PodSpec(containers=[], volumes=volumes))


def test_a_token_only_for_pods_with_the_api_servers_projected_token() -> None:
    api = client.V1VolumeProjection(
        service_account_token=client.V1ServiceAccountTokenProjection(path="token")
    )
    other = client.V1VolumeProjection(
        service_account_token=client.V1ServiceAccountTokenProjection(path="t", audience="vault")
    )
    assert wants_token(_pod(api))
    assert wants_token(_pod(other, api))
    # automountServiceAccountToken: false leaves no kube-api-access volume: no token, as
    # from a real kubelet (and NodeRestriction would refuse one for the API's audience).
    assert not wants_token(_pod())
    assert not wants_token(_pod(other))
