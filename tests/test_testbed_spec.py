"""A shaped network's subnet is IPv4 inside 198.18.0.0/15, and anything else is refused in one
line: an IPv6 subnet too, which once reached ipaddress's version check as a TypeError."""

import pytest

from orchestrator.testbed.network import NetworkSpec, ShapedNetworkError


def test_an_ipv6_subnet_is_refused_as_not_ipv4():
    with pytest.raises(ShapedNetworkError, match="'fd00::/120' is not an IPv4 network"):
        NetworkSpec(subnet="fd00::/120")
    assert NetworkSpec(subnet="198.19.0.0/24").subnet == "198.19.0.0/24"
