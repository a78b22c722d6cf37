"""zspeed.core"""
