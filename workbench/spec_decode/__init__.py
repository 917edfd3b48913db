"""Speculative decoding: proposers of draft tokens and what verifies them."""
