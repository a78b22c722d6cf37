"""zspeed.kernels"""
