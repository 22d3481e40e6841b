"""Stores and file formats: HDF5, NetCDF3/4, Zarr and .npy stores (`stores`), HDF5 records read
straight from the file's bytes (`direct_reads`), NetCDF3 files and Zarr chunk files read as they
lie on disk (`netcdf3`, `zarr_chunks`), the FNO's fields files (`field_files`), many files as one
dataset and its index (`file_index`, `member_leases`), and rewriting a store's chunks (`rechunk`).
"""
