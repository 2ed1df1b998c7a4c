"""quantspec.infer"""
