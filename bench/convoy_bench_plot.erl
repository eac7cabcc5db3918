%% PNG plots of a result with gnuplot (Debian's gnuplot-nox has `pngcairo'; plain
%% `png' is the fallback). Each plot is a `.dat' file of medians (or of ratios), a
%% `.gp' script and the `.png'; plots whose scenario was not run are left out.
%% `sizes' and `pairs' get lines, `latency' and `hol' percentiles; every other
%% scenario a bar chart of its primary figure against the baseline
%% (`convoy_bench_bars').
-module(convoy_bench_plot).

-export([plots/2]).

%% @doc Make every plot the result has data for. Returns the PNG files made and
%% notes about those that could not be made.
-spec plots(file:filename(), map()) -> {[file:filename()], [binary()]}.
plots(Dir, #{scenarios := Scenarios}) ->
    case os:find_executable("gnuplot") of
        false ->
            {[], [<<"gnuplot not found: no plots (apt-get install gnuplot-nox)">>]};
        Gnuplot ->
            Driver = terminal(Gnuplot),
            Term = Driver ++ " size 900,560 noenhanced",
            Wanted = [{sizes, mb_s, "sizes_mb_s", "throughput vs message size (one sender)",
                       "message size (bytes)", "MB/s", size},
                      {sizes, msg_s, "sizes_msg_s", "messages/s vs message size (one sender)",
                       "message size (bytes)", "msg/s", size},
                      {pairs, rt_s, "pairs_rt_s", "throughput vs concurrency (request/response pairs)",
                       "concurrent pairs", "round trips/s", pairs},
                      {pairs, p99_us, "pairs_p99", "p99 round trip vs concurrency",
                       "concurrent pairs", "p99 (us)", pairs}],
            Percentiles = [latency, hol],
            Charted = Percentiles ++ [Name || {Name, _, _, _, _, _, _} <- Wanted],
            Results = [line_plot(Gnuplot, Term, Dir, S, W)
                       || W = {Name, _, _, _, _, _, _} <- Wanted,
                          S = #{name := N} <- Scenarios, N =:= Name]
                ++ [latency_plot(Gnuplot, Term, Dir, S)
                    || S = #{name := N} <- Scenarios, lists:member(N, Percentiles)]
                ++ [bar_plot(Gnuplot, Driver, Dir, S)
                    || S = #{name := N} <- Scenarios, not lists:member(N, Charted)],
            {[F || {ok, F} <- Results], [Why || {error, Why} <- Results]}
    end.

terminal(Gnuplot) ->
    Probe = os:cmd(Gnuplot ++ " -e \"set terminal pngcairo\" 2>&1"),
    case string:find(Probe, "unknown") of
        nomatch -> "pngcairo";
        _ -> "png"
    end.

%% One line per variant (per variant and message shape when the points have
%% several, as `pairs' does): x from the point's parameter, y the figure's median.
line_plot(Gnuplot, Term, Dir, #{spec := #{points := Points}, summary := Summary},
          {_, Fig, Base, Title, XLabel, YLabel, XParam}) ->
    Variants = variants(Summary),
    %% A series per message shape and pace (`pairs' also has paced points).
    Key = fun(Params) -> {maps:get(shape, Params, none), maps:get(pace_ms, Params, 0)} end,
    Shapes = lists:foldl(fun(#{params := Params}, Acc) ->
                                 Shape = Key(Params),
                                 Acc ++ [Shape || not lists:member(Shape, Acc)]
                         end, [], Points),
    Series = [{V, Shape} || Shape <- Shapes, V <- Variants],
    Xs = lists:usort([maps:get(XParam, Params) || #{params := Params} <- Points]),
    At = fun(X, Shape) ->
                 [L || #{label := L, params := Params} <- Points,
                       maps:get(XParam, Params) =:= X,
                       Key(Params) =:= Shape]
         end,
    Rows = [[integer_to_list(X)
             | [case At(X, Shape) of
                    [Label | _] -> cell(Summary, V, Label, Fig);
                    [] -> "?"
                end || {V, Shape} <- Series]]
            || X <- Xs],
    Tic = fun(X) ->
                  [Label | _] = [L || #{label := L, params := Params} <- Points,
                                      maps:get(XParam, Params) =:= X],
                  hd(string:split(Label, ", "))
          end,
    Name = fun({V, {none, 0}}) -> V;
              ({V, _}) when length(Shapes) =:= 1 -> V;
              ({V, {Shape, 0}}) -> [V, " ", atom_to_list(Shape)];
              ({V, {Shape, Pace}}) ->
                   io_lib:format("~s ~s, ~s", [V, Shape, convoy_bench_scenarios:apart(Pace)])
           end,
    Script = ["set terminal ", Term, "\n",
              "set output '", Base, ".png'\n",
              "set title '", Title, "'\n",
              "set xlabel '", XLabel, "'\nset ylabel '", YLabel, "'\n",
              "set logscale x 2\nset logscale y\nset grid\nset key outside right\n",
              "set xtics (", lists:join(", ", [io_lib:format("\"~s\" ~b", [Tic(X), X])
                                               || X <- Xs]),
              ")\n",
              "set datafile missing '?'\n",
              "plot ", lists:join(", ", [io_lib:format("'~s.dat' using 1:~b with linespoints "
                                                       "title '~s'", [Base, I + 1, Name(S)])
                                         || {I, S} <- enumerate(Series)]), "\n"],
    render(Gnuplot, Dir, Base, dat(["x" | [Name(S) || S <- Series]], Rows), Script).

%% Percentiles per variant, clustered bars.
latency_plot(Gnuplot, Term, Dir, #{name := Name, summary := Summary}) ->
    Base = atom_to_list(Name) ++ "_percentiles",
    Variants = variants(Summary),
    Label = hd([L || #{point := L} <- Summary]),
    Pcts = [{"p50", p50_us}, {"p99", p99_us}, {"p99.9", p999_us}, {"max", max_us}],
    Present = [{T, F} || {T, F} <- Pcts,
                         lists:any(fun(V) -> cell(Summary, V, Label, F) =/= "?" end,
                                   Variants)],
    Rows = [[T | [cell(Summary, V, Label, F) || V <- Variants]] || {T, F} <- Present],
    Title = case Name of
                latency -> "idle round trip latency percentiles";
                hol -> "round trip latency under bulk traffic (head of line)"
            end,
    Script = ["set terminal ", Term, "\n",
              "set output '", Base, ".png'\n",
              "set title '", Title, "'\n",
              "set ylabel 'microseconds'\nset logscale y\nset grid ytics\n",
              "set style data histogram\nset style histogram clustered gap 1\n",
              "set style fill solid 0.8 border -1\nset key outside right\n",
              "set datafile missing '?'\n",
              "plot ", lists:join(", ", [io_lib:format("'~s.dat' using ~b:xtic(1) title '~s'",
                                                       [Base, I + 1, V])
                                         || {I, V} <- enumerate(Variants)]), "\n"],
    render(Gnuplot, Dir, Base, dat(["percentile" | Variants], Rows), Script).

%% The primary figure against the baseline, a bar per variant and point (on a
%% canvas as wide as the bars need).
bar_plot(Gnuplot, Driver, Dir, Scenario) ->
    case convoy_bench_bars:chart(Driver, Scenario) of
        {ok, #{base := Base, dat := Dat, script := Script}} ->
            render(Gnuplot, Dir, Base, Dat, Script);
        {error, _} = Error ->
            Error
    end.

variants(Summary) ->
    lists:foldl(fun(#{variant := V, status := ok}, Acc) ->
                        case lists:member(V, Acc) of
                            true -> Acc;
                            false -> Acc ++ [V]
                        end;
                   (_, Acc) -> Acc
                end, [], Summary).

cell(Summary, V, Label, Fig) ->
    case [M || #{variant := V2, point := L, figures := #{Fig := #{median := M}}} <- Summary,
               V2 =:= V, L =:= Label] of
        [M | _] -> float_to_list(float(M), [short]);
        [] -> "?"
    end.

dat(Cols, Rows) ->
    [header(Cols), [[lists:join(" ", R), "\n"] || R <- Rows]].

header(Cols) -> ["# ", lists:join(" ", [quote(C) || C <- Cols]), "\n"].

quote(C) -> ["\"", C, "\""].

enumerate(L) -> lists:zip(lists:seq(1, length(L)), L).

render(Gnuplot, Dir, Base, Data, Script) ->
    Dat = filename:join(Dir, Base ++ ".dat"),
    Gp = filename:join(Dir, Base ++ ".gp"),
    Png = filename:join(Dir, Base ++ ".png"),
    ok = file:write_file(Dat, Data),
    ok = file:write_file(Gp, Script),
    Port = open_port({spawn_executable, Gnuplot},
                     [{args, [Base ++ ".gp"]}, {cd, Dir}, exit_status, stderr_to_stdout,
                      binary]),
    case collect(Port, <<>>) of
        {0, _} ->
            case filelib:is_regular(Png) of
                true -> {ok, Png};
                false -> {error, iolist_to_binary(["gnuplot made no ", Base, ".png"])}
            end;
        {Status, Out} ->
            {error, iolist_to_binary(io_lib:format("gnuplot failed on ~s.gp (exit ~p): ~s",
                                                   [Base, Status, Out]))}
    end.

collect(Port, Acc) ->
    receive
        {Port, {data, D}} -> collect(Port, <<Acc/binary, D/binary>>);
        {Port, {exit_status, S}} -> {S, Acc}
    after 60000 ->
        port_close(Port),
        {timeout, Acc}
    end.
