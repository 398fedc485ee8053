"""The one byte formatter: the same count prints the same way in the plan, the rehearsal view
and the report."""

from orchestrator.units import format_bytes


def test_decimal_counts_switch_to_gigabytes_at_a_tenth_of_one():
    assert format_bytes(99_999_999) == "100.0 MB"
    assert format_bytes(100_000_000) == "0.10 GB"
    assert format_bytes(12_345_678_901) == "12.35 GB"
    assert format_bytes(-2_500_000_000) == "-2.50 GB"
    assert format_bytes(-50_000_000) == "-50.0 MB"
    assert format_bytes(1_234_567, megabyte_places=2) == "1.23 MB"
    assert format_bytes(0) == "0.0 MB"


def test_binary_counts_switch_to_gibibytes_at_one_and_separate_thousands():
    assert format_bytes(2**30 - 2**20, binary=True) == "1,023.0 MiB"
    assert format_bytes(2**30, binary=True) == "1.00 GiB"
    assert format_bytes(1536 * 2**30, binary=True) == "1,536.00 GiB"
    assert format_bytes(3 * 2**19, binary=True) == "1.5 MiB"


def test_no_count_is_a_dash():
    assert format_bytes(None) == "-"
    assert format_bytes(None, binary=True) == "-"
