from shoal.analytics.cli import main

main()
