"""The mesh and what splits over it: mesh axes, sharding maps, pipeline stages, and the bytes a
compiled program's collectives move."""
