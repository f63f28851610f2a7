"""The turn: a pure core (state, evolve, decisions), its runner and its actor."""
