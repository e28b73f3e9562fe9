"""Guarded rollouts: a change to a role's workers goes to a canary revision, is judged
against the stable revision on the pool's rollback conditions, and is completed or
rolled back."""
