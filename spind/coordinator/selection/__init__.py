"""SSM selection: the selector protocol, LBSS (the paper's learning-based selector), the baselines, their estimates,
Kuhn-Munkres matching under capacities, request features, and counterfactual n-gram drafts."""
