"""The comparison lab: other locking approaches beside distlock, under the same faults."""
