"""quantspec.report"""
