"""``ember launch`` / ``ember config`` / ``ember env``, and ``notebook_launcher``."""
from ember.errors import UsageError  # noqa: F401
from ember.launch.command import (add_launch_arguments, add_subcommands, config_command,  # noqa: F401
                                  default_config_path, default_launch_config, env_command, env_report,
                                  first_failure, launch, load_launch_config, read_yaml, resolve_launch_config,
                                  torchrun_argv, unordered_failures, validate_launch_config, wizard, worker_env,
                                  write_config)
