"""Reaching a Ray cluster: the embedded one, one by address, remote jobs through the Jobs API,
and the checks that say in one line why an address does not answer."""
