%% `bin/convoy-bench page DIR': a run's results (DIR/results.json) as a Markdown
%% page a user can read: the host and the command first, then per scenario what it
%% measures, one table of every variant's primary figure beside plain, the best
%% kernel flag and the floors (`handover', `guarded', `ceiling') where they ran,
%% and beside the other variants some rows are compared with (`batch''s with
%% `convoy' and `send_many', convoy's with `manifold'), and the run's charts.
%% `bench/RESULTS.md' is such a page, so every figure on it comes from one run
%% whose command, date and host it prints. Runs given with `--also DIR' follow
%% the first, each under its own heading with its command, date and host (a run
%% on a capped link, which `make bench' does not make, for example).
-module(convoy_bench_page).

-export([run/1, page/2, page/3]).

%% @doc Print the page of `Dir''s run; with `charts' set, copy the run's charts
%% there and link them by that directory's name (the page is meant to sit in the
%% directory above it, as bench/RESULTS.md sits above bench/charts).
-spec run(#{page := file:filename(), charts := file:filename() | undefined,
            also := [file:filename()], _ => _}) ->
          {ok, map()} | {error, binary()}.
run(#{page := Dir, charts := Charts, also := AlsoDirs}) ->
    case read_all([Dir | AlsoDirs]) of
        {ok, [Result | Also]} ->
            Pngs = filelib:wildcard("*.png", Dir),
            Links = case Charts of
                        undefined ->
                            [];
                        _ ->
                            ok = filelib:ensure_path(Charts),
                            [{ok, _} = file:copy(filename:join(Dir, P), filename:join(Charts, P))
                             || P <- Pngs],
                            [filename:join(filename:basename(Charts), P) || P <- Pngs]
                    end,
            io:put_chars(page(Result, Links, Also)),
            {ok, #{page => Dir, charts => Links, also => AlsoDirs}};
        {error, _} = Error ->
            Error
    end.

read_all(Dirs) ->
    lists:foldr(fun(Dir, {ok, Acc}) ->
                        case file:read_file(filename:join(Dir, "results.json")) of
                            {ok, Json} ->
                                {ok, Result} = convoy_bench_json:decode(Json),
                                {ok, [Result | Acc]};
                            {error, Why} ->
                                {error, iolist_to_binary(
                                          io_lib:format("cannot read ~s/results.json: ~p",
                                                        [Dir, Why]))}
                        end;
                   (_Dir, Error) ->
                        Error
                end, {ok, []}, Dirs).

%% @doc The page of a decoded results.json, linking the charts `Links' (paths as
%% the page should write them; each chart goes with the scenario its name starts
%% with).
-spec page(map(), [file:filename()]) -> iolist().
page(R, Links) ->
    page(R, Links, []).

%% @doc `page/2' followed by the runs `Also', each with its own command and host.
-spec page(map(), [file:filename()], [map()]) -> iolist().
page(R = #{<<"config">> := C, <<"scenarios">> := Scenarios}, Links, Also) ->
    ["# Results\n\n",
     "One run of the harness (`bin/convoy-bench`, see [README.md](README.md)), made with\n\n",
     header(C),
     reading(),
     check(R, "##"),
     [scenario(S, Links, "##") || S <- Scenarios],
     [also(A) || A <- Also]].

%% Another run: its link (a capped one says so), command and host, its tables.
also(R = #{<<"config">> := C, <<"scenarios">> := Scenarios}) ->
    ["## Another run: ", lists:join(", ", [N || #{<<"name">> := N} <- Scenarios]),
     case link_rate(maps:get(<<"args">>, C, [])) of
         none -> "";
         Rate -> [" on a link capped at ", Rate]
     end,
     "\n\nMade with\n\n",
     header(C),
     check(R, "###"),
     [scenario(S, [], "###") || S <- Scenarios]].

link_rate([<<"--link-rate">>, Rate | _]) -> Rate;
link_rate([_ | Rest]) -> link_rate(Rest);
link_rate([]) -> none.

%%--------------------------------------------------------------------
%% The host, the command, how to read

header(C = #{<<"facts">> := F}) ->
    Args = [binary_to_list(A) || A <- as_typed(maps:get(<<"args">>, C, []))],
    ["```sh\nbin/convoy-bench ", lists:join(" ", [quoted(A) || A <- Args]), "\n```\n\n",
     "| | |\n|---|---|\n",
     row("date", maps:get(<<"started">>, C, <<"?">>)),
     row("commit", maps:get(<<"commit">>, C, <<"not recorded">>)),
     row("host", maps:get(<<"host">>, F, <<"?">>)),
     row("CPU", [maps:get(<<"cpu_model">>, F, <<"not recorded">>), ", ",
                 integer_to_list(maps:get(<<"logical_processors">>, F, 0)),
                 " logical processors"]),
     row("memory", case maps:get(<<"memory_gib">>, F, null) of
                       null -> "not recorded";
                       G -> [number(G), " GiB"]
                   end),
     row("OS", maps:get(<<"os">>, F, <<"not recorded">>)),
     row("OTP", [maps:get(<<"otp_release">>, F, <<"?">>), " (erts ",
                 maps:get(<<"erts_version">>, F, <<"?">>), "), ",
                 integer_to_list(maps:get(<<"schedulers_online">>, F, 0)), " schedulers"]),
     row("nodes", maps:get(<<"nodes">>, C, <<"?">>)),
     row("duration", [number(maps:get(<<"seconds">>, C, 0) / 60), " min"]),
     "\n"].

row(K, V) ->
    ["| ", K, " | ", V, " |\n"].

%% The arguments as the user typed them: `bin/convoy-bench --netns --rate R'
%% runs the harness in a namespace with `--nodes', `--nodes-note' (the page's
%% nodes row) and `--link-rate R' added before the user's own.
as_typed([<<"--nodes">>, _, <<"--nodes-note">>, <<"network namespaces:", _/binary>> | Rest]) ->
    case Rest of
        [<<"--link-rate">>, Rate | User] -> [<<"--netns">>, <<"--rate">>, Rate | User];
        User -> [<<"--netns">> | User]
    end;
as_typed(Args) ->
    Args.

quoted(A) ->
    case lists:any(fun(C) -> lists:member(C, " []'\"") end, A) of
        true -> [$', A, $'];
        false -> A
    end.

reading() ->
    ["## How to read these figures\n\n",
     "Each cell is the median over the run's repeats, the variants of a scenario\n",
     "interleaved point by point, so a slow spell of the machine falls on all of them.\n",
     "\"x plain\" is the median of the per-repeat ratios to `!` between the same two\n",
     "nodes (to `!` on one node in `local`); for a latency, below 1 is faster. \"x best\n",
     "flag\" compares with the better of `dist_nodelay false` and `delay_send` in the\n",
     "same repeat, \"x handover\" and \"x guarded\" with a bare batching process and with\n",
     "that process doing only the per-message work convoy's promises need (the floor\n",
     "convoy is judged against), \"x ceiling\" with the sender batching by hand;\n",
     "\"x convoy\" and \"x send_many\" give `batch` (convoy's sends inside\n",
     "`convoy:batch/1`) against convoy's single sends and the sender's own lists,\n",
     "and a variant with settings of its own (`convoy[compress=auto]`) against\n",
     "convoy's defaults; one with the defaults spelled out (`convoy[compress=never]`)\n",
     "shows what convoy against itself does in that run,\n",
     "\"x manifold\" convoy's multicast against discord/manifold's in `fanout`.\n",
     "Absolute rates belong to this host, and the ratios too: on a host with other\n",
     "cores, another network or other load, the same code gives other ratios.\n",
     "Compare ratios within one run; measure your own cluster with `make bench`.\n\n"].

check(#{<<"check">> := #{<<"within">> := N, <<"cells">> := M} = Ch}, Level) ->
    [Level, " The check\n\n",
     io_lib:format("`--check`: ~b of ~b convoy cells within tolerance of plain (throughput "
                   "at least 0.95x, p50 at most 1.10x, p99 at most 1.25x).~n", [N, M]),
     case maps:get(<<"failures">>, Ch, []) of
         [] -> "\n";
         Fs -> ["\n| scenario | point | figure | ratio | limit |\n|---|---|---|---|---|\n",
                [["| ", S, " | ", P, " | ", Fig, " | ", number(Ra), " | ", L, " |\n"]
                 || #{<<"scenario">> := S, <<"point">> := P, <<"figure">> := Fig,
                      <<"ratio">> := Ra, <<"limit">> := L} <- Fs], "\n"]
     end];
check(_, _Level) ->
    [].

%%--------------------------------------------------------------------
%% A scenario

scenario(S = #{<<"name">> := Name, <<"title">> := Title, <<"spec">> := Spec}, Links, Level) ->
    #{<<"primary">> := #{<<"figure">> := Fig, <<"better">> := Better}} = Spec,
    Label = label(Spec, Fig),
    Summary = maps:get(<<"summary">>, S, []),
    %% `local' (`!' on one node) is shown where it is the baseline only
    Rows = [E || E = #{<<"variant">> := V} <- Summary,
                 V =/= <<"local">> orelse Name =:= <<"local">>],
    Cols = columns(Rows, Fig),
    [Level, " ", Name, "\n\n", Title, ".\n\n",
     "| point | variant | ", Label, " | ", lists:join(" | ", [H || {H, _} <- Cols]), " |\n",
     "|---|---|---|", [["---|"] || _ <- Cols], "\n",
     [["| ", P, " | ", V, " | ", cell(E, Fig, Spec), " | ",
       lists:join(" | ", [ratio(from(E, Keys, Fig)) || {_, Keys} <- Cols]), " |\n"]
      || E = #{<<"point">> := P, <<"variant">> := V} <- Rows],
     case Better of
         <<"lower">> -> ["\n", Label, ": lower is better; ratios below 1 are faster.\n"];
         _ -> []
     end,
     "\n",
     [["![", Name, ": ", filename:rootname(filename:basename(L)), "](", L, ")\n\n"]
      || L <- Links, is_chart_of(Name, filename:basename(L))]].

label(#{<<"figures">> := Figures}, Fig) ->
    case [L || #{<<"key">> := K, <<"label">> := L} <- Figures, K =:= Fig] of
        [L | _] -> L;
        [] -> Fig
    end.

%% The ratio columns (heading, the summary's keys to the ratios) the scenario has
%% data for, in the page's order: the baseline, the limits, then the variants
%% some rows are compared with (`beside_ratios').
columns(Rows, Fig) ->
    Beside = lists:uniq([V || #{<<"beside_ratios">> := B} <- Rows,
                              V <- lists:sort(maps:keys(B))]),
    All = [{"x plain", [<<"ratios">>]}, {"x best flag", [<<"flag_ratios">>]},
           {"x handover", [<<"handover_ratios">>]}, {"x guarded", [<<"guarded_ratios">>]},
           {"x ceiling", [<<"ceiling_ratios">>]}]
        ++ [{["x ", V], [<<"beside_ratios">>, V]} || V <- Beside],
    [C || C = {_, Keys} <- All, lists:any(fun(E) -> from(E, Keys, Fig) =/= null end, Rows)].

from(E, [], Fig) ->
    case E of
        #{Fig := #{<<"median">> := M}} -> M;
        _ -> null
    end;
from(E, [Key | Keys], Fig) ->
    case E of
        #{Key := #{} = Under} -> from(Under, Keys, Fig);
        _ -> null
    end.

cell(#{<<"status">> := <<"ok">>, <<"figures">> := #{} = Figs}, Fig, Spec) ->
    case Figs of
        #{Fig := #{<<"median">> := M, <<"min">> := Lo, <<"max">> := Hi}} ->
            Unit = binary_to_existing_atom(unit(Spec, Fig)),
            [value(M, Unit), " [", value(Lo, Unit), " - ", value(Hi, Unit), "]"];
        _ ->
            "-"
    end;
cell(#{<<"status">> := Status}, _Fig, _Spec) ->
    Status.

unit(#{<<"figures">> := Figures}, Fig) ->
    case [U || #{<<"key">> := K, <<"unit">> := U} <- Figures, K =:= Fig] of
        [U | _] -> U;
        [] -> <<"number">>
    end.

ratio(null) -> "";
ratio(R) -> number(R).

is_chart_of(Name, File) ->
    N = byte_size(Name),
    case list_to_binary(File) of
        <<Name:N/binary, Sep, _/binary>> when Sep =:= $_; Sep =:= $. -> true;
        _ -> false
    end.

%%--------------------------------------------------------------------
%% Numbers, as the harness's table prints them

value(V, Unit) ->
    convoy_bench_report:value(V, Unit).

number(V) ->
    convoy_bench_report:number(V).
