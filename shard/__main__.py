from shard.cli import main

main()
