"""Admission: the waiting queue's order (policy), the step's token budgets
(the adder), which requests run and which are preempted (the decision), and
the plan entries and joins of the admitted requests."""
