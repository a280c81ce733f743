"""What the stored facts mean: correlation, verdict, replicas, outliers, hosts."""
