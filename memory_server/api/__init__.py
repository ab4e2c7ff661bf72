"""Thin HTTP routes: parse, call a service, return a response model."""
