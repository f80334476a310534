"""Attention of live query tokens at arbitrary absolute positions (seams, a live tail, decode) over
a contiguous key/value context, with GQA: reference (naive.py) and one Triton kernel (triton.py)."""
