"""fv plugin: DBCache / FBCache / TaylorSeer block interceptors."""
