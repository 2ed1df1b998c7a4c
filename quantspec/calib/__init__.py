"""quantspec.calib"""
