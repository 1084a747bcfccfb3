"""sbp_spark.spark"""
