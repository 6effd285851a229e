"""Launch-grid arithmetic in plain Python for the host side of kernel launches.

triton.cdiv and triton.next_power_of_2 are constexpr functions: each host call unwraps its
arguments through Triton's machinery (microseconds each, docs/benchmarks.md), and the
launches pay it per layer per step. These give the same integers (for n >= 1).
"""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
