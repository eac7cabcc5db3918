# convoy works between nodes, so this node must be distributed, and it must be
# before convoy starts: mix.exs makes `mix test` mean `mix test --no-start`, so
# the applications are started here, after Node.start/2.
defmodule ElixirDemo.TestNode do
  # Starts epmd if it is not running (`epmd -daemon` returns before it listens,
  # so wait for it), then distribution under a name unique on this host.
  def start do
    {_, 0} = System.cmd(System.find_executable("epmd") || "epmd", ["-daemon"])
    await_epmd(100)
    {:ok, _} = Node.start(:"elixir_demo_#{System.pid()}", :shortnames)
  end

  defp await_epmd(0), do: raise("epmd is not answering")

  defp await_epmd(tries) do
    with {:error, _} <- :erl_epmd.names() do
      Process.sleep(50)
      await_epmd(tries - 1)
    end
  end
end

# What both test modules ask of the nodes.
defmodule ElixirDemo.TestWait do
  import ExUnit.Assertions, only: [flunk: 1]

  # How convoy on `at` sends to `node`: :convoy, or :plain until it knows that
  # convoy runs there.
  def route(at \\ node(), node),
    do: get_in(:erpc.call(at, :convoy, :info, []), [:nodes, node, :route])

  def await(fun, tries \\ 100) do
    cond do
      fun.() ->
        :ok

      tries > 0 ->
        Process.sleep(50)
        await(fun, tries - 1)

      true ->
        flunk("condition not met")
    end
  end
end

ElixirDemo.TestNode.start()
{:ok, _} = Application.ensure_all_started(:elixir_demo)

ExUnit.start()
