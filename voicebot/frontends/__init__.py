"""The protocol front ends: each translates its wire to the session's commands and events."""
